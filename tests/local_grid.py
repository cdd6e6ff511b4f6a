"""A Flower ``Grid`` that delivers messages to ClientApps in this process: strategies tested end to end
without a SuperLink."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from tests.helpers import Nodes


class LocalGrid(Nodes):
    """``num_nodes`` SuperNodes (node ids 100, 101, ...) with partitions ``0..num_nodes-1``, each running
    ``client_app``; ``fail`` holds partitions whose ClientApp raises. Replies keep node order."""

    def __init__(self, client_app: ClientApp, num_nodes: int, fail: Iterable[int] = ()) -> None:
        super().__init__(num_nodes)
        self.client_app = client_app
        self.fail = set(fail)
        self.pending: dict[str, Message] = {}
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                state=RecordDict(),
                run_config={},
                node_config={"partition-id": i, "num-partitions": num_nodes},
            )
            for i, node in enumerate(self.get_node_ids())
        }

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message's ClientApp now; its reply waits for ``pull_messages``."""
        self.pending = {reply.metadata.reply_to_message_id: reply for reply in self.send_and_receive(messages)}
        return list(self.pending)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids``, in push order."""
        wanted = set(message_ids)
        return [reply for message_id, reply in self.pending.items() if message_id in wanted]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            context = self.contexts[message.metadata.dst_node_id]
            try:
                if context.node_config["partition-id"] in self.fail:
                    raise RuntimeError("this client fails")
                reply = self.client_app(message, context)
            except Exception as error:  # what a SuperNode reports for a failing ClientApp
                reply = Message(Error(code=0, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
            replies.append(reply)
        return replies
