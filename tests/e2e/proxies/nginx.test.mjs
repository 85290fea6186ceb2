// The nginx recipe (deploy/proxies/nginx/runfeed.conf) in front of runfeed and a stub webapp: see suite.mjs.
// Run by scripts/proxies.sh, which installs Debian's nginx if it is missing.
import { proxySuite } from "./suite.mjs";

proxySuite("nginx");
