"""Test doubles for the node agent: a kubelet simulator and other faithful stand-ins."""
