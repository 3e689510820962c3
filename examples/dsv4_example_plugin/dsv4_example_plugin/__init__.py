"""Example third-party plugin for dsv4 (see plugin.py)."""
