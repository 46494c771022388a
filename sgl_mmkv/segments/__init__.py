"""Image segments and the radix cache that serves them."""
