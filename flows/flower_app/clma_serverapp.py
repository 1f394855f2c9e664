"""ServerApp of a CLMA federation on real clients: the Prefect flow over the Flower
transport (flows.flower_serverapp)."""

import flows.flower_serverapp as _serverapp

app = _serverapp.app
