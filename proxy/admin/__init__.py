"""What the dashboard and the admin API under ``/admin`` show (their routes: ``proxy.api``), and who may use them."""

from proxy._credentials import Admin, AdminAuth
from proxy.admin._token_texts import TokenTexts

__all__ = ["Admin", "AdminAuth", "TokenTexts"]
