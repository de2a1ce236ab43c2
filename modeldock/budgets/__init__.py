"""Token budgets: tokens and money a tenant may spend per window or calendar period (reserve, settle)."""
