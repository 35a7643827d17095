"""The broker as one delivery is settled through: ack, reply, dead-letter, requeue.

``delivery`` holds :class:`BrokerDelivery`, one AMQP delivery as the
``Delivery`` a session settles (the session's driver calls it directly),
and :class:`ConfirmedPublisher`, the confirmed publish that survives a
reconnect, through which replies, the outbox republish and dead-letter
copies go. The daemon's broker link owns the publisher and hands it each
connection's publish channel; neither object holds a scope's or a session's
state, and neither decides what a frame gets.
"""

from octo_worker.transport.delivery import BrokerDelivery, ConfirmedPublisher

__all__ = ["BrokerDelivery", "ConfirmedPublisher"]
