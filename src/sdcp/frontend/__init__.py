"""The front end (a client of the router, SDCP 6.1, and the reader of output, 6.7): what a user's
request meets first. The OpenAI-compatible API (requests parsed and bounded, answers, tool calls,
JSON schemas, the Responses API), the gateway service that serves it, the text codec (chat
templates, tokens to text) and the client that opens sessions through a router and reads their
output."""
