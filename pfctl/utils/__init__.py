"""Small shared utilities (atomic file writes, hashing)."""
