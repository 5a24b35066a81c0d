"""Model-family adapters that swap the delta-rule core; filled by the patch_model work."""
