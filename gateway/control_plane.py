"""The gateway's calls to the control plane's internal REST API, with the internal token: the internal API's
client (diptych_common/internal_api/client.py), named here for the gateway's modules."""

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable

__all__ = ["ControlPlaneClient", "ControlPlaneUnavailable"]
