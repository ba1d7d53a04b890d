"""KV transfer between servers (lesson 18): a prompt's blocks shipped from the server that prefilled it to the one
that decodes it (`payload.py`: what is shipped and checked)."""
