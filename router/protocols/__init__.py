"""Wire formats: OpenAI, Anthropic Messages, OpenAI Responses, rerank and audio bodies, and the output events every encoder consumes."""
