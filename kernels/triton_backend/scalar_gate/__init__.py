"""DeltaNet and GDN: one gate value per token and head (or none)."""
