"""Test helpers shared across test folders (tiny model builders, a paged-cache driver)."""
