"""A request's prompt: segments, chat templates, and finding known chunks in flat text."""
