"""checkpoint layer (see DESIGN.md)."""
