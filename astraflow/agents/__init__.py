"""Agent programs that talk to a model through the OpenAI API only (see `openai_http`)."""
