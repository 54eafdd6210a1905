"""Integrations of the kvax attention op into upstream model stacks (each imports its stack lazily)."""
