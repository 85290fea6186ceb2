// The caddy recipe (deploy/proxies/caddy/Caddyfile) in front of runfeed and a stub webapp: see suite.mjs.
// Run by scripts/proxies.sh, which installs Debian's caddy if it is missing.
import { proxySuite } from "./suite.mjs";

proxySuite("caddy");
