"""Model configs and decoder implementations."""
