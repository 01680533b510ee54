from tests.e2e.roles import roles

__all__ = ["roles"]
