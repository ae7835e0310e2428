"""An in-process Flower Grid for driving ``Strategy.start`` without Ray."""

from __future__ import annotations


class LocalGrid:
    """A Grid of ``n`` nodes answered in-process by ``client(node_index, message)``."""

    def __init__(self, n, client):
        self.ids, self.client, self.sent = [1000 + 7 * i for i in range(n)], client, []

    def get_node_ids(self):
        return list(self.ids)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent.append([m.metadata.dst_node_id for m in messages])
        return [self.client(self.ids.index(m.metadata.dst_node_id), m) for m in messages]

    @property
    def train(self):
        """The nodes sent train messages, per round (``start`` sends train, then evaluate)."""
        return self.sent[0::2]
