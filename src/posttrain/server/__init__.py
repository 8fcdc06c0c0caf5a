"""posttrain serve: a Tinker-compatible HTTP API and OpenAI-compatible sampling (extra `server`)."""
