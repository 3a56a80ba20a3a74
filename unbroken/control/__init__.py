"""control layer (see DESIGN.md)."""
