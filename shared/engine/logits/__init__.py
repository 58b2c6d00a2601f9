"""Logits processing: penalties, logit bias, grammar constraints and reasoning budgets (see processor.py)."""
