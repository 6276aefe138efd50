#!/bin/bash
set -euo pipefail
sed -i -e 's/^port[[:space:]]*=.*/port = 9090/' -e 's/^debug[[:space:]]*=.*/debug = false/' /app/config.ini
