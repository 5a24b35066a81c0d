"""KDA and GDN2: one gate value per token, head and key channel."""
