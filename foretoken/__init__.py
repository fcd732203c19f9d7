"""foretoken: predict LLM time-to-first-token before a request is sent, route and admit on it,
and grade every prediction afterwards."""

__version__ = "0.1.0"
