"""Request limits: which tenant a key is, and how many requests it may send and have in flight (token
and cost budgets are `modeldock.budgets`)."""
