"""Admission: who may send what, and how often, before an endpoint is chosen."""
