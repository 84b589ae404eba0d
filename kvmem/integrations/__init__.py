"""Doors for agent frameworks over kvmem (docs/agents.md): langgraph.py, a LangGraph BaseStore.

Each is a thin adapter over the KVMem facade or over the HTTP API, never a second service; the
MCP server has its own package (kvmem/mcp/). Nothing in kvmem imports these.
"""
