"""Scoring responses: the rule verifier and the generative reward model (GenRM) judge."""
