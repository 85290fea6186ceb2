// Debian's headless chromium for the browser tests, driven by playwright-core.
// Env: BROWSER_CHROMIUM (default /usr/bin/chromium; scripts/browser.sh installs it).
import { chromium } from "playwright-core";

export const CHROMIUM = process.env.BROWSER_CHROMIUM ?? "/usr/bin/chromium";

/**
 * Launches CHROMIUM headless with the flags every browser test uses (no sandbox, GPU, QUIC,
 * first-run, background networking, component updates or sync) plus `extraArgs`. playwright-core
 * gives every launch a fresh, empty --user-data-dir of its own.
 */
export function launchChromium(extraArgs = []) {
  return chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    chromiumSandbox: false,
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      ...extraArgs,
    ],
  });
}
