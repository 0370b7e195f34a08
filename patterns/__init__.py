"""Rewrite patterns, one per file; the import list in this module is the priority order."""
