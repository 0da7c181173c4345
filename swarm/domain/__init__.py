"""The domain types every layer shares; nothing here imports the rest of swarm.

- :mod:`~swarm.domain.messages`: chat messages, usage, a model's result and stream events;
- :mod:`~swarm.domain.history`: pure functions that keep a message list valid;
- :mod:`~swarm.domain.session`: one saved conversation;
- :mod:`~swarm.domain.approval`: an approval request and its decision;
- :mod:`~swarm.domain.spawn`: one ``agent`` call;
- :mod:`~swarm.domain.stop`: a stop signal whose setting also cuts blocking calls short.
"""
