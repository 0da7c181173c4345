"""swarm: a shell agent over any OpenAI-compatible API that can go berserk."""

__version__ = "0.1.0"
