/*
 * heatmap.h -- attention maps as text, shaded as the seeds draw them
 * (mha example, mha viz --ascii).
 */
#ifndef MHA_TOOL_HEATMAP_H
#define MHA_TOOL_HEATMAP_H

#include <stdio.h>

/*
 * Prints n maps side by side, each (rows, cols), row-major, shaded
 * " ░▒▓█" relative to that map's largest value, with titles above and
 * optional one-character labels for rows and columns.
 */
void tool_heatmaps(FILE *f, const float *const *maps, const char *const *titles,
                   int n, int rows, int cols, const char *row_labels,
                   const char *col_labels);

#endif
