"""Example tasks on collab's bring-your-own-model API (installed with the project)."""
