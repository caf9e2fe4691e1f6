"""The admin API and the dashboard under ``/admin``, and who may use them."""

from proxy.admin._auth import Admin, AdminAuth
from proxy.admin._token_texts import TokenTexts

__all__ = ["Admin", "AdminAuth", "TokenTexts"]
