"""The app the chaos workers run: the service's own declaration plus the claiming handler.

The claiming handler (tests/chaos/claiming.py) is test code and stays out of the service; the
app declaration names the modules the engine searches for handlers, so a declaration of its
own is how the chaos workers get it on the unchanged production path.
"""

from __future__ import annotations

import dataclasses

from service.app import app as service_app

app = dataclasses.replace(service_app, handlers=(*service_app.handlers, "tests.chaos.claiming"))
