"""Model families (one file each) and the registry that maps HF architecture names to them."""
