"""Endpoint discovery: where the endpoints of each model come from."""
