// Builds the live-runs page into tests/browser/dist (a static dir; relative asset URLs so any
// static server can serve it from any path).
import { defineConfig } from "vite";
import react from "@vitejs/plugin-react";

export default defineConfig({
  plugins: [react()],
  base: "./",
  logLevel: "warn",
  build: { outDir: "dist", emptyOutDir: true, sourcemap: false, chunkSizeWarningLimit: 2000 },
});
