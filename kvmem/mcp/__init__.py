"""kvmem's MCP server: memory as tools for agents (docs/agents.md).

caller.py (who calls: tenant from the key, scope from the connection), tools.py (the seven tools),
server.py (the MCPServer, the /mcp route `kvmem serve` and `kvmem gateway` mount, and stdio for
`kvmem mcp`). It sits beside the HTTP server: it uses the KVMem facade, and only server/ and
cli/ import it.
"""
