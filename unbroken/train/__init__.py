"""train layer (see DESIGN.md)."""
