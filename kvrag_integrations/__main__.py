"""``python -m kvrag_integrations``: the demo (see kvrag_integrations.demo)."""

from kvrag_integrations.demo import main

main()
