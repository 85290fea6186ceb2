// The haproxy recipe (deploy/proxies/haproxy/haproxy.cfg) in front of runfeed and a stub webapp: see suite.mjs.
// Run by scripts/proxies.sh, which installs Debian's haproxy if it is missing.
import { proxySuite } from "./suite.mjs";

proxySuite("haproxy");
