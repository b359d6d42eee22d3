"""Running models: sessions, options, compiled programs."""
