"""Thin DVC stage shells: read inputs, call the tpgrpo library, write outputs atomically."""
