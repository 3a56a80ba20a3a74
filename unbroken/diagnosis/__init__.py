"""diagnosis layer (see DESIGN.md)."""
