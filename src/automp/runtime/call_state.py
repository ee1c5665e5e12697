"""Which root module's call this thread is inside. Nested module calls pass straight through the session, and an
RNN inside a root on automp's compiled path runs as one fused op (rnn.py): both need to know, without a lookup."""
from __future__ import annotations

import threading

local = threading.local()  # depth > 0 inside a root's call; path: the Route that root runs on; low: its dtype
