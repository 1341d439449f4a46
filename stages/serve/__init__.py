"""The serve stage: Llama-family runtime, paged KV cache engine, offline generate and the HTTP server."""
