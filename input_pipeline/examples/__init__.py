"""Example builders: how each method turns documents into training records (host side,
numpy)."""
