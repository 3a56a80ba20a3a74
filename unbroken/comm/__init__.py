"""comm layer (see DESIGN.md)."""
